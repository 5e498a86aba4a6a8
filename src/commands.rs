//! The subcommands other than the proxy itself. Each runs on its own, talking to a running
//! proxy only through its admin API or its drain socket; none is part of the data path.
//! - [`r#await`]: `lameduck await`, an app (a Job's) run under the proxy's lifecycle;
//! - [`hook`]: `lameduck prestop` / `poststart`, the app containers' Kubernetes hooks;
//! - [`inject`]: `lameduck inject`, the proxy added to Kubernetes workloads;
//! - [`iptables`]: `lameduck iptables`, the NAT rules of an intercepted pod (its init container);
//! - [`status`]: `lameduck status`, the proxy's state for people;
//! - [`webhook`]: `lameduck webhook`, the admission webhook that injects pods as they are made.

pub mod r#await;
pub mod hook;
pub mod inject;
pub mod iptables;
pub mod status;
pub mod webhook;
